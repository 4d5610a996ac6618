"""CTR models built from a dataset's feeds, and their held-out AUC (what `hetps train --model` runs;
the AUC is `train(eval_data=...)`'s final evaluation, runtime/evaluation/evaluate.py).

Every categorical feature is a field: each `sparse` column, and each multi-valued column as the
sum of its bag's embeddings (pad id 0 has a row of its own, so the sum also tells the bag's
length). All fields share one [vocab, dim] table (ids are salted by column, see `schema`).
- `wide_deep`: logit = sum of per-id scalar weights (wide) + MLP([fields, dense]) (deep);
- `deepfm`: logit = the wide term + the factorisation-machine term 0.5 * sum((sum v)^2 - sum v^2)
  over the fields' vectors + MLP([fields, dense]);
- `dlrm`: dense through a bottom MLP to `dim`, dot products of all feature vectors (Z Z^T), a top
  MLP over [bottom output, products].
The loss is the mean log loss of sigmoid(logit).
"""

from __future__ import annotations

from runtime.data.files.schema import Schema
from transpiler import builder as nn
from transpiler.ir import Program
from transpiler.models import Model

MODELS = ("wide_deep", "deepfm", "dlrm")


def build_model(
    kind: str,
    schema: Schema,
    shapes: dict[str, tuple[int, ...]],
    dim: int = 8,
    hidden: tuple[int, ...] = (64, 32),
    optimizer: nn.Optimizer | None = None,
    seed: int = 0,
) -> Model:
    """Model `kind` for feeds of these per-example `shapes` (`Dataset.feed_shapes()`)."""
    if kind not in MODELS:
        raise ValueError(f"model {kind!r}: expected one of {MODELS}")
    main, startup = Program(), Program()
    main.attrs["random_seed"] = seed
    with nn.program_guard(main, startup):
        label = nn.data("label", [-1, 1], "float32")
        feeds, fields, wide = [], [], []
        small = {"type": "uniform", "low": -0.01, "high": 0.01}
        linear = kind != "dlrm"  # DLRM has no wide (per-id scalar) term
        if "sparse" in shapes:
            k = shapes["sparse"][0]
            ids = nn.data("sparse", [-1, k], "int64")
            feeds.append("sparse")
            fields.append(nn.embedding(ids, schema.vocab, dim, name="emb"))  # [n, k, dim]
            if linear:
                wide.append(
                    nn.reduce_sum(nn.embedding(ids, schema.vocab, 1, name="wide", initializer=small), [1])
                )
        for col, _ in schema.multi:
            bag = nn.data(col, [-1, schema.max_len], "int64")
            feeds.append(col)
            fields.append(nn.reduce_sum(nn.embedding(bag, schema.vocab, dim, name="emb"), [1], keepdims=True))
            if linear:
                wide.append(
                    nn.reduce_sum(nn.embedding(bag, schema.vocab, 1, name="wide", initializer=small), [1])
                )
        dense = None
        if "dense" in shapes:
            dense = nn.data("dense", [-1, shapes["dense"][0]], "float32")
            feeds.append("dense")
        if not fields:
            raise ValueError(
                "the schema has no categorical column (sparse: or multi:): these models need one"
            )
        z = nn.concat(fields, axis=1) if len(fields) > 1 else fields[0]  # [n, F, dim]
        count = shapes.get("sparse", (0,))[0] + len(schema.multi)  # F
        if kind == "dlrm":
            logit = _dlrm(z, dense, count, dim, hidden)
        else:
            flat = nn.reshape(z, [-1, count * dim])
            x = nn.concat([flat, dense], axis=1) if dense is not None else flat
            logit = nn.fc(_mlp(x, hidden), 1)
            for w in wide:
                logit = nn.add(logit, nn.reshape(w, [-1, 1]))
            if kind == "deepfm":
                s = nn.reduce_sum(z, [1])  # [n, dim]
                fm = nn.sub(nn.mul(s, s), nn.reduce_sum(nn.mul(z, z), [1]))
                logit = nn.add(
                    logit,
                    nn.reshape(
                        nn.append("scale", {"X": nn.reduce_sum(fm, [1])}, {"scale": 0.5})["Out"], [-1, 1]
                    ),
                )
        loss = nn.reduce_mean(nn.sigmoid_cross_entropy_with_logits(logit, label))
        pred = nn.sigmoid(logit)
        if optimizer is not None:
            optimizer.minimize(loss)
    return Model(main, startup, [*feeds, "label"], loss, pred)


def _mlp(x, hidden: tuple[int, ...]):
    for size in hidden:
        x = nn.fc(x, size, act="relu")
    return x


def _dlrm(z, dense, fields: int, dim: int, hidden: tuple[int, ...]):
    feats, n = z, fields
    bottom = None
    if dense is not None:
        bottom = nn.fc(_mlp(dense, hidden[:1]), dim, act="relu")
        feats, n = nn.concat([nn.reshape(bottom, [-1, 1, dim]), z], axis=1), fields + 1
    zt = nn.append("transpose", {"data": feats}, {"perm": [0, 2, 1]})["transposed"]
    inter = nn.reshape(nn.append("matmul", {"A": feats, "B": zt})["Y"], [-1, n * n])
    h = nn.concat([bottom, inter], axis=1) if bottom is not None else inter
    return nn.fc(_mlp(h, hidden), 1)


def fit(
    kind: str,
    data,
    *,
    eval_data=None,
    epochs: int | None = None,
    steps: int | None = None,
    lr: float = 0.01,
    dim: int = 8,
    **train_kw,
) -> tuple[Model, object, float]:
    """Build model `kind` from `data`'s schema and feeds, transpile and train it on `data` with Adam,
    then score `eval_data` (held-out, read with the same schema): (model, History, held-out AUC or
    NaN without eval data)."""
    from runtime.driver.train import train

    model = build_model(kind, data.schema, data.feed_shapes(), dim=dim, optimizer=nn.Adam(lr=lr))
    hist = train(
        model.main, data, epochs=epochs, steps=steps, return_params=True, eval_data=eval_data, **train_kw
    )
    score = hist.eval[-1]["auc"] if eval_data is not None else float("nan")  # runtime.evaluate's, at the end
    return model, hist, score
