"""Reference CTR models written with the builder (used by tutorials, tests and benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass, field

from transpiler.frontends import builder as nn
from transpiler.ir import Program, Var


@dataclass
class Model:
    """A built model: its programs and the vars a user feeds and fetches."""

    main: Program
    startup: Program
    feeds: list[str]
    loss: Var
    pred: Var  # a multi-task model's: its first task's
    preds: dict[str, Var] = field(default_factory=dict)  # a multi-task model's prediction per task


def wide_deep(
    num_slots: int = 26,
    vocab: int = 1000,
    dim: int = 8,
    num_dense: int = 13,
    hidden: tuple[int, ...] = (64, 32),
    optimizer: nn.Optimizer | None = None,
    seed: int = 0,
    dtype: str = "float32",
) -> Model:
    """Wide&Deep: wide = sum of per-id scalar weights; deep = MLP over [embeddings, dense];
    logit = wide + deep; loss = mean log loss. `optimizer=None` leaves it forward-only."""
    main, startup = Program(), Program()
    main.attrs["random_seed"] = seed
    with nn.program_guard(main, startup):
        ids = nn.data("sparse", [-1, num_slots], "int64")
        dense = nn.data("dense", [-1, num_dense], dtype)
        label = nn.data("label", [-1, 1], dtype)
        small = {"type": "uniform", "low": -0.01, "high": 0.01}
        wide = nn.reduce_sum(
            nn.embedding(ids, vocab, 1, name="wide_emb", initializer=small, dtype=dtype), axes=[1]
        )
        emb = nn.embedding(ids, vocab, dim, name="deep_emb", dtype=dtype)
        h = nn.concat([nn.reshape(emb, [-1, num_slots * dim]), dense], axis=1)
        for size in hidden:
            h = nn.fc(h, size, act="relu")
        logit = nn.add(nn.fc(h, 1), wide)
        loss = nn.reduce_mean(nn.sigmoid_cross_entropy_with_logits(logit, label))
        pred = nn.sigmoid(logit)
        if optimizer is not None:
            optimizer.minimize(loss)
    return Model(main, startup, ["sparse", "dense", "label"], loss, pred)


def dlrm(
    num_slots: int = 8,
    vocab: int = 1000,
    dim: int = 8,
    bag: int = 4,
    num_dense: int = 13,
    bottom: tuple[int, ...] = (32,),
    top: tuple[int, ...] = (32, 16),
    pooling: str = "sum",
    optimizer: nn.Optimizer | None = None,
    seed: int = 0,
    dtype: str = "float32",
) -> Model:
    """DLRM-like: slot i feeds a bag of `bag` ids (`slot_i`, int64 [-1, bag]) into its own
    [vocab, dim] table, pooled by `pooling` (sum | mean); `dense` goes through the bottom MLP to
    `dim`; the F = num_slots + 1 feature vectors interact by dot products, Z @ Z^T with Z the
    stacked features [F, dim] (Z^T stacked directly as [dim, F]); the top MLP maps [bottom output,
    the F*F products] to a logit; loss = mean log loss."""
    if pooling not in ("sum", "mean"):
        raise ValueError(f"pooling {pooling!r}: expected 'sum' or 'mean'")
    pool = nn.reduce_sum if pooling == "sum" else nn.reduce_mean
    main, startup = Program(), Program()
    main.attrs["random_seed"] = seed
    with nn.program_guard(main, startup):
        slots = [nn.data(f"slot_{i}", [-1, bag], "int64") for i in range(num_slots)]
        dense = nn.data("dense", [-1, num_dense], dtype)
        label = nn.data("label", [-1, 1], dtype)
        pooled = [
            pool(nn.embedding(ids, vocab, dim, name=f"emb_{i}", dtype=dtype), axes=[1])
            for i, ids in enumerate(slots)
        ]
        x = dense
        for size in bottom:
            x = nn.fc(x, size, act="relu")
        x = nn.fc(x, dim, act="relu")
        feats = [x, *pooled]
        z = nn.concat([nn.reshape(f, [-1, 1, dim]) for f in feats], axis=1)
        zt = nn.concat([nn.reshape(f, [-1, dim, 1]) for f in feats], axis=2)
        inter = nn.reshape(nn.append("matmul", {"A": z, "B": zt})["Y"], [-1, len(feats) ** 2])
        h = nn.concat([x, inter], axis=1)
        for size in top:
            h = nn.fc(h, size, act="relu")
        logit = nn.fc(h, 1)
        loss = nn.reduce_mean(nn.sigmoid_cross_entropy_with_logits(logit, label))
        pred = nn.sigmoid(logit)
        if optimizer is not None:
            optimizer.minimize(loss)
    return Model(main, startup, [s.name for s in slots] + ["dense", "label"], loss, pred)


def _shared_input(num_slots: int, vocab: int, dim: int, num_dense: int, dtype: str) -> tuple[list[Var], Var]:
    """The feeds `sparse` [-1, num_slots] and `dense`, and [one shared embedding per id, dense] flat."""
    ids = nn.data("sparse", [-1, num_slots], "int64")
    dense = nn.data("dense", [-1, num_dense], dtype)
    emb = nn.embedding(ids, vocab, dim, name="shared_emb", dtype=dtype)
    return [ids, dense], nn.concat([nn.reshape(emb, [-1, num_slots * dim]), dense], axis=1)


def _tower(x: Var, hidden: tuple[int, ...]) -> Var:
    for size in hidden:
        x = nn.fc(x, size, act="relu")
    return nn.fc(x, 1)


def esmm(
    num_slots: int = 26,
    vocab: int = 1000,
    dim: int = 8,
    num_dense: int = 13,
    hidden: tuple[int, ...] = (32, 16),
    weights: dict[str, float] | None = None,
    optimizer: nn.Optimizer | None = None,
    seed: int = 0,
    dtype: str = "float32",
) -> Model:
    """ESMM (Ma et al., SIGIR 2018), two tasks over every impression: a CTR tower and a CVR tower
    over shared embeddings; pCTR = sigmoid(ctr logit), pCTCVR = pCTR x sigmoid(cvr logit); loss =
    BCE(pCTR, click) + BCE(pCTCVR, buy) (`weights` scale them), with `buy` = click AND purchase
    (runtime.data.SyntheticMultiTask draws such labels). Tasks "ctr" and "ctcvr"."""
    main, startup = Program(), Program()
    main.attrs["random_seed"] = seed
    with nn.program_guard(main, startup):
        feeds, x = _shared_input(num_slots, vocab, dim, num_dense, dtype)
        click, buy = nn.data("click", [-1, 1], dtype), nn.data("buy", [-1, 1], dtype)
        ctr_logit, cvr_logit = _tower(x, hidden), _tower(x, hidden)
        p_ctr = nn.append("sigmoid", {"X": ctr_logit}, Y="ctr")["Y"]  # outputs named by task
        p_ctcvr = nn.append("mul", {"A": p_ctr, "B": nn.sigmoid(cvr_logit)}, C="ctcvr")["C"]
        ctr_loss = nn.reduce_mean(nn.sigmoid_cross_entropy_with_logits(ctr_logit, click))
        ctcvr_loss = nn.reduce_mean(nn.bce(p_ctcvr, buy))
        tasks = {"ctr": (p_ctr, click, ctr_loss), "ctcvr": (p_ctcvr, buy, ctcvr_loss)}
        loss = nn.multi_task_loss(tasks, weights)
        if optimizer is not None:
            optimizer.minimize(loss)
    preds = {"ctr": p_ctr, "ctcvr": p_ctcvr}
    return Model(main, startup, [f.name for f in feeds] + ["click", "buy"], loss, p_ctr, preds)


def mmoe(
    num_slots: int = 26,
    vocab: int = 1000,
    dim: int = 8,
    num_dense: int = 13,
    experts: int = 3,
    expert_size: int = 16,
    tower: tuple[int, ...] = (8,),
    labels: tuple[str, str] = ("click", "buy"),
    weights: dict[str, float] | None = None,
    optimizer: nn.Optimizer | None = None,
    seed: int = 0,
    dtype: str = "float32",
) -> Model:
    """MMOE (Ma et al., KDD 2018): `experts` expert MLPs over shared embeddings; per task a softmax
    gate over the experts mixes their outputs into its tower; one sigmoid output per task, each
    with a log loss against its label (tasks named as `labels`, weighted by `weights`)."""
    main, startup = Program(), Program()
    main.attrs["random_seed"] = seed
    with nn.program_guard(main, startup):
        feeds, x = _shared_input(num_slots, vocab, dim, num_dense, dtype)
        outs = [nn.reshape(nn.fc(x, expert_size, act="relu"), [-1, 1, expert_size]) for _ in range(experts)]
        stacked = nn.concat(outs, axis=1)  # [B, experts, expert_size]
        tasks, preds = {}, {}
        for name in labels:
            label = nn.data(name, [-1, 1], dtype)
            gate = nn.reshape(nn.softmax(nn.fc(x, experts), axis=1), [-1, experts, 1])
            mixed = nn.reduce_sum(nn.mul(stacked, gate), axes=[1])
            logit = _tower(mixed, tower)
            preds[name] = nn.append("sigmoid", {"X": logit}, Y=f"{name}_prob")["Y"]
            tasks[name] = (
                preds[name],
                label,
                nn.reduce_mean(nn.sigmoid_cross_entropy_with_logits(logit, label)),
            )
        loss = nn.multi_task_loss(tasks, weights)
        if optimizer is not None:
            optimizer.minimize(loss)
    return Model(main, startup, [f.name for f in feeds] + list(labels), loss, preds[labels[0]], preds)
