"""Tutorial 08: a PyTorch model trained by hetps (`from_torch`).

    pip install 'hetps[torch]'
    python tutorials/09_pytorch_model.py                  # 300 steps
    python tutorials/09_pytorch_model.py --steps 40       # small (what the tests run)

What it does:
  1. defines a Wide&Deep-style `torch.nn.Module` (an embedding table for the categorical slots, a
     per-id scalar "wide" weight, an MLP over [embeddings, dense]), returning click probabilities;
  2. `from_torch(module, (ids, dense), input_names=["sparse", "dense"], loss="bce")` exports it with
     torch.onnx in this process and imports the ONNX graph: the inputs are named like the data's
     feeds, a mean log loss is attached against a new `label` input;
  3. transpiles it (the embedding lookups become sparse parameter-server tables on the cpu trainer,
     the MLP goes to the gpu trainer) and trains it on synthetic click data;
  4. scores a held-out set with the trained weights and, as a check, with the PyTorch module
     itself after loading the trained weights into it (the two agree to float rounding).
"""

from __future__ import annotations

import argparse

import numpy as np

SLOTS, DENSE, VOCAB, DIM = 8, 4, 2000, 8


def make_module():
    import torch

    class WideDeep(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, DIM)
            self.wide = torch.nn.Embedding(VOCAB, 1)
            self.mlp = torch.nn.Sequential(
                torch.nn.Linear(SLOTS * DIM + DENSE, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
            )

        def forward(self, ids, dense):
            deep = self.mlp(torch.cat([self.emb(ids).flatten(1), dense], dim=1))
            return torch.sigmoid(deep + self.wide(ids).sum(dim=1))

    torch.manual_seed(0)
    return WideDeep()


def main(argv: list[str] | None = None) -> dict:
    import torch

    from runtime import evaluate, train
    from runtime.data import SyntheticCTR
    from transpiler import from_torch, transpile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=256)
    args = ap.parse_args(argv)

    module = make_module()
    example = (torch.zeros(2, SLOTS, dtype=torch.long), torch.zeros(2, DENSE))
    program = from_torch(module, example, input_names=["sparse", "dense"], loss="bce")
    plan = transpile(program)
    print(plan.summary())

    data = SyntheticCTR(vocab=VOCAB, num_slots=SLOTS, num_dense=DENSE, seed=0)
    held_out = [data.batch(10**6 + i, 1024) for i in range(4)]
    before = evaluate(plan, held_out)
    hist = train(
        plan,
        data,
        steps=args.steps,
        batch_size=args.batch,
        trainers={"cpu": 1, "gpu": 1},
        allow_emulation=True,
        return_params=True,
        progress=False,
    )
    plan.params.update(hist.params)  # the trained weights, by parameter name
    after = evaluate(plan, held_out)
    print(f"held-out AUC {before['auc']:.4f} before training, {after['auc']:.4f} after {args.steps} steps")
    gap = torch_check(module, program, hist.params, held_out[0])
    print(f"the PyTorch module with the trained weights: largest difference {gap:.2e}")
    return {"auc_before": before["auc"], "auc_after": after["auc"], "torch_gap": gap}


def torch_check(module, program, params: dict, batch: dict) -> float:
    """Load the trained weights into `module` (ONNX initializers are named after the module's
    parameters) and compare its predictions with hetps's forward pass of the same weights."""
    import torch

    from runtime import Executor

    missing = [k for k in module.state_dict() if k not in params]
    if missing:
        raise KeyError(f"trained weights lack the module's parameters {missing}")
    module.load_state_dict({k: torch.from_numpy(np.asarray(params[k])) for k in module.state_dict()})
    with torch.no_grad():
        ref = module(torch.from_numpy(batch["sparse"]), torch.from_numpy(batch["dense"])).numpy()
    program.params.update(params)
    (got,) = Executor().run(program, feed=batch, fetch_list=[program.fetch_names[0]])
    return float(np.max(np.abs(np.asarray(got).reshape(ref.shape) - ref)))


if __name__ == "__main__":  # trainers are spawned processes: a script needs this guard
    main()
