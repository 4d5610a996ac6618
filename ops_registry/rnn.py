"""Recurrent layers with ONNX semantics: GRU and LSTM (forward, reverse, bidirectional).

Shapes (layout 0; layout 1 swaps the sequence and batch axes of X, Y, Y_h, Y_c, initial_h and
initial_c, as ONNX defines): X [seq, batch, input]; W [dirs, G*H, input]; R [dirs, G*H, H];
B [dirs, 2*G*H] (Wb then Rb); sequence_lens [batch]; initial_h / initial_c [dirs, batch, H];
P [dirs, 3*H] (LSTM peepholes i, o, f); Y [seq, dirs, batch, H]; Y_h / Y_c [dirs, batch, H]. G is
3 for GRU (gates z, r, h) and 4 for LSTM (gates i, o, f, c).

`sequence_lens` (as onnxruntime computes it): a sequence of length L is read at steps 0..L-1 (the
reverse direction from L-1 down to 0); Y is 0 at steps >= L and the final states are the states
after its last valid step (0 for an empty sequence, L = 0). X needs at least one step. `clip`
bounds every gate's input (after the peephole terms) to [-clip, clip] before its activation, as
onnxruntime does; LSTM `input_forget` couples the forget gate to the input gate, f = 1 - i. Only
the default activations are implemented (GRU sigmoid / tanh, LSTM sigmoid / tanh / tanh);
`activations` naming others are refused by name.

The gradient (backward through time) recomputes the forward inside the gradient kernel, keeping
each step's gate activations, so the forward op passes no intermediates on.
"""

from __future__ import annotations

from typing import Any

from ops_registry.base import OpDef, register
from ops_registry.errors import HetpsError
from ops_registry.nn import _sigmoid

DIRECTIONS = {"forward": 1, "reverse": 1, "bidirectional": 2}
DEFAULT_ACTIVATIONS = {"gru": ("sigmoid", "tanh"), "lstm": ("sigmoid", "tanh", "tanh")}
GATES = {"gru": 3, "lstm": 4}
_ATTRS = {
    "direction": "forward",
    "layout": 0,
    "hidden_size": None,
    "activations": None,
    "activation_alpha": None,
    "activation_beta": None,
    "clip": None,
}


class RnnAttributeError(HetpsError, NotImplementedError):
    """A GRU / LSTM attribute (or input) hetps does not implement."""


def check_attrs(kind: str, ins: dict, attrs: dict) -> int:
    """Refuse what is not implemented, naming the attribute; the number of directions."""
    op = kind.upper()
    direction = attrs.get("direction", "forward")
    if direction not in DIRECTIONS:
        raise ValueError(f"{op}: direction {direction!r} is not one of {sorted(DIRECTIONS)}")
    dirs = DIRECTIONS[direction]
    acts = attrs.get("activations")
    if acts is not None:
        want = [a for _ in range(dirs) for a in DEFAULT_ACTIVATIONS[kind]]
        if [str(a).lower() for a in acts] != want:
            raise RnnAttributeError(
                f"{op}: attribute activations={list(acts)} is not implemented; only the default "
                f"{[a.capitalize() for a in want]} (drop the attribute or use these)"
            )
    if attrs.get("clip") is not None and not attrs["clip"] > 0:
        raise ValueError(f"{op}: clip={attrs['clip']} must be positive")
    if attrs.get("layout", 0) not in (0, 1):
        raise ValueError(f"{op}: layout {attrs['layout']} is not 0 or 1")
    w, r = ins["W"], ins["R"]
    hidden = r.shape[-1]
    if w.shape[0] != dirs or r.shape != (dirs, GATES[kind] * hidden, hidden):
        raise ValueError(
            f"{op}: W {list(w.shape)} / R {list(r.shape)} do not fit direction "
            f"{direction!r} ({dirs} direction(s), {GATES[kind]} gates)"
        )
    if attrs.get("hidden_size") not in (None, hidden):
        raise ValueError(f"{op}: hidden_size={attrs['hidden_size']} but R says {hidden}")
    return dirs


def _seq_major(xp, ins: dict, attrs: dict) -> dict:
    """The inputs with X [seq, batch, input] and the initial states [dirs, batch, H] (layout 0)."""
    ins = dict(ins)
    if attrs.get("layout", 0) == 1:
        ins["X"] = xp.swapaxes(ins["X"], 0, 1)
        for s in ("initial_h", "initial_c"):
            if s in ins:
                ins[s] = xp.swapaxes(ins[s], 0, 1)
    return ins


def _to_layout(xp, attrs: dict, y, states: list) -> tuple:
    """Outputs in the op's layout: Y [seq, dirs, batch, H] -> [batch, seq, dirs, H] for layout 1."""
    if attrs.get("layout", 0) == 1:
        return xp.transpose(y, (2, 0, 1, 3)), [xp.swapaxes(s, 0, 1) for s in states]
    return y, states


def _order(xp, lens, steps: int, batch: int, reverse: bool) -> tuple[Any, Any]:
    """(idx [seq, batch], valid [seq, batch, 1]): step k of a direction reads X[idx[k, b], b].
    Reverse reads each sequence backwards within its length; idx is its own inverse, so it maps
    processing order back to time order too."""
    k = xp.arange(steps)[:, None]
    n = xp.full((batch,), steps, dtype=k.dtype) if lens is None else lens.astype(k.dtype)
    valid = k < n[None, :]
    idx = xp.where(valid, n[None, :] - 1 - k, k) if reverse else xp.broadcast_to(k, (steps, batch))
    return idx, valid[:, :, None]


def _gather(seq, idx, cols):
    return seq[idx, cols]


def _directions(xp, kind: str, ins: dict, attrs: dict):
    """Per direction: (d, idx, valid, cols, its weights and initial states)."""
    dirs = check_attrs(kind, ins, attrs)
    x, r = ins["X"], ins["R"]
    steps, batch, hidden = x.shape[0], x.shape[1], r.shape[-1]
    if steps == 0:
        raise ValueError(f"{kind.upper()}: X {list(x.shape)} has no steps (seq_length 0)")
    g = GATES[kind]
    lens = ins.get("sequence_lens")
    if lens is not None and (
        lens.shape != (batch,) or batch and (int(lens.max()) > steps or int(lens.min()) < 0)
    ):
        raise ValueError(
            f"{kind.upper()}: sequence_lens {lens.tolist()} must be [batch={batch}] values in 0..{steps}"
        )
    zeros = xp.zeros((dirs, batch, hidden), dtype=x.dtype)
    b = ins.get("B", xp.zeros((dirs, 2 * g * hidden), dtype=x.dtype))
    p = ins.get("P", None)
    cols = xp.arange(batch)[None, :]
    reverse = [attrs.get("direction") == "reverse", True][:dirs]
    for d in range(dirs):
        idx, valid = _order(xp, lens, steps, batch, reverse[d])
        yield (
            d,
            idx,
            valid,
            cols,
            {
                "w": ins["W"][d],
                "r": r[d],
                "wb": b[d, : g * hidden],
                "rb": b[d, g * hidden :],
                "p": None if p is None else p[d],
                "h0": ins.get("initial_h", zeros)[d],
                "c0": ins.get("initial_c", zeros)[d],
                "clip": attrs.get("clip"),
                "coupled": bool(attrs.get("input_forget")),
            },
        )


def _clip(xp, v, bound):
    """(v clipped to [-bound, bound], where it was inside: the clip's derivative); (v, None)
    without a bound."""
    if bound is None:
        return v, None
    return xp.clip(v, -bound, bound), xp.abs(v) <= bound


def _through(d, inside):
    """A gradient through `_clip`."""
    return d if inside is None else d * inside


# -- GRU ------------------------------------------------------------------------------------------
def gru_steps(xp, x, prm: dict, valid, lbr: bool, keep: bool) -> tuple:
    """One direction's GRU over x [steps, batch, input] in processing order: (y, h_last, cache).

    z = sigmoid(Xt Wz' + Ht-1 Rz' + Wbz + Rbz); r = sigmoid(Xt Wr' + Ht-1 Rr' + Wbr + Rbr);
    h~ = tanh(Xt Wh' + (r * Ht-1) Rh' + Rbh + Wbh), or with linear_before_reset
    h~ = tanh(Xt Wh' + r * (Ht-1 Rh' + Rbh) + Wbh); Ht = (1 - z) * h~ + z * Ht-1.
    """
    w, r, rb = prm["w"], prm["r"], prm["rb"]
    hid = r.shape[-1]
    xw = xp.matmul(x, w.T) + prm["wb"]
    xw[..., : 2 * hid] += rb[: 2 * hid]
    rzr, rh, rbh = r[: 2 * hid].T, r[2 * hid :].T, rb[2 * hid :]
    h, ys, cache = prm["h0"], [], []
    for t in range(x.shape[0]):
        zr, in_zr = _clip(xp, xw[t, :, : 2 * hid] + h @ rzr, prm["clip"])
        zr = _sigmoid(xp, zr)
        z, rg = zr[:, :hid], zr[:, hid:]
        if lbr:
            lin = h @ rh + rbh
            hh, in_h = _clip(xp, xw[t, :, 2 * hid :] + rg * lin, prm["clip"])
        else:
            lin = rg * h
            hh, in_h = _clip(xp, xw[t, :, 2 * hid :] + lin @ rh + rbh, prm["clip"])
        hh = xp.tanh(hh)
        hn = (1 - z) * hh + z * h
        if keep:
            cache.append((h, z, rg, hh, lin, in_zr, in_h))
        ys.append(xp.where(valid[t], hn, 0))
        h = xp.where(valid[t], hn, h)
    return xp.stack(ys), xp.where(valid[0], h, 0), cache


def gru_steps_grad(xp, x, prm: dict, valid, lbr: bool, cache: list, dy, dh) -> dict:
    """Backward through time of `gru_steps`: dy [steps, batch, H] (processing order) and dh (the
    last state's gradient) -> dx, dw, dr, db (Wb then Rb), dh0."""
    w, r = prm["w"], prm["r"]
    hid = r.shape[-1]
    steps = x.shape[0]
    rzr, rh = r[: 2 * hid], r[2 * hid :]
    dxw = xp.zeros((steps, x.shape[1], 3 * hid), dtype=x.dtype)
    drin = xp.zeros_like(dxw)  # the gradient of each gate's recurrent term (Ht-1 R' + Rb)
    dh = xp.where(valid[0], dh, 0)  # an empty sequence's last state is 0, not initial_h
    for t in range(steps - 1, -1, -1):
        hp, z, rg, hh, lin, in_zr, in_h = cache[t]
        g = xp.where(valid[t], dh + dy[t], 0)
        dhh = _through(g * (1 - z) * (1 - hh * hh), in_h)
        dz = g * (hp - hh) * z * (1 - z)
        dhp = g * z
        if lbr:
            dlin = dhh * rg
            drg = dhh * lin
            dhp = dhp + dlin @ rh
        else:
            dlin = dhh
            drh = dhh @ rh
            drg = drh * hp
            dhp = dhp + drh * rg
        dzr = _through(xp.concatenate([dz, drg * rg * (1 - rg)], axis=1), in_zr)
        dz, drg = dzr[:, :hid], dzr[:, hid:]
        dxw[t] = xp.concatenate([dz, drg, dhh], axis=1)
        drin[t] = xp.concatenate([dz, drg, dlin], axis=1)
        dhp = dhp + drin[t, :, : 2 * hid] @ rzr
        dh = dhp + xp.where(valid[t], 0, dh)
    hps = xp.stack([c[0] for c in cache])
    rin_h = hps if lbr else xp.stack([c[4] for c in cache])  # what Rh multiplies
    flat = _flat2
    dr = xp.concatenate(
        [flat(drin[..., : 2 * hid]).T @ flat(hps), flat(drin[..., 2 * hid :]).T @ flat(rin_h)], axis=0
    )
    db = xp.concatenate([dxw.sum(axis=(0, 1)), drin.sum(axis=(0, 1))])
    return {"x": xp.matmul(dxw, w), "w": flat(dxw).T @ flat(x), "r": dr, "b": db, "h0": dh}


def _flat2(a):
    return a.reshape(-1, a.shape[-1])


# -- LSTM -----------------------------------------------------------------------------------------
def lstm_steps(xp, x, prm: dict, valid, keep: bool) -> tuple:
    """One direction's LSTM over x [steps, batch, input] in processing order: (y, h, c, cache).

    i = sigmoid(Xt Wi' + Ht-1 Ri' + Pi * Ct-1 + Wbi + Rbi); f = sigmoid(... f ... + Pf * Ct-1)
    (1 - i with input_forget);
    c~ = tanh(Xt Wc' + Ht-1 Rc' + Wbc + Rbc); Ct = f * Ct-1 + i * c~;
    o = sigmoid(Xt Wo' + Ht-1 Ro' + Po * Ct + Wbo + Rbo); Ht = o * tanh(Ct).
    """
    hid = prm["r"].shape[-1]
    xw = xp.matmul(x, prm["w"].T) + (prm["wb"] + prm["rb"])
    rt, p = prm["r"].T, prm["p"]
    h, c, ys, cache = prm["h0"], prm["c0"], [], []
    for t in range(x.shape[0]):
        gates = xw[t] + h @ rt
        ipre, opre, fpre = gates[:, :hid], gates[:, hid : 2 * hid], gates[:, 2 * hid : 3 * hid]
        if p is not None:
            ipre, fpre = ipre + p[:hid] * c, fpre + p[2 * hid :] * c
        (ipre, in_i), (fpre, in_f) = _clip(xp, ipre, prm["clip"]), _clip(xp, fpre, prm["clip"])
        ccpre, in_c = _clip(xp, gates[:, 3 * hid :], prm["clip"])
        i, cc = _sigmoid(xp, ipre), xp.tanh(ccpre)
        f = 1 - i if prm["coupled"] else _sigmoid(xp, fpre)
        cn = f * c + i * cc
        opre, in_o = _clip(xp, opre if p is None else opre + p[hid : 2 * hid] * cn, prm["clip"])
        o = _sigmoid(xp, opre)
        tc = xp.tanh(cn)
        hn = o * tc
        if keep:
            cache.append((h, c, i, o, f, cc, cn, tc, (in_i, in_o, in_f, in_c)))
        ys.append(xp.where(valid[t], hn, 0))
        h, c = xp.where(valid[t], hn, h), xp.where(valid[t], cn, c)
    return xp.stack(ys), xp.where(valid[0], h, 0), xp.where(valid[0], c, 0), cache


def lstm_steps_grad(xp, x, prm: dict, valid, cache: list, dy, dh, dc) -> dict:
    """Backward through time of `lstm_steps`: dy (processing order), dh, dc (the last states'
    gradients) -> dx, dw, dr, db (Wb then Rb), dp, dh0, dc0."""
    r, p = prm["r"], prm["p"]
    hid = r.shape[-1]
    steps = x.shape[0]
    dg = xp.zeros((steps, x.shape[1], 4 * hid), dtype=x.dtype)
    dp = xp.zeros((3 * hid,), dtype=x.dtype)
    dh, dc = xp.where(valid[0], dh, 0), xp.where(valid[0], dc, 0)  # an empty sequence's: 0
    for t in range(steps - 1, -1, -1):
        hp, cp, i, o, f, cc, cn, tc, (in_i, in_o, in_f, in_c) = cache[t]
        gh = xp.where(valid[t], dh + dy[t], 0)
        do = _through(gh * tc * o * (1 - o), in_o)
        dcn = xp.where(valid[t], dc, 0) + gh * o * (1 - tc * tc)
        if p is not None:
            dcn = dcn + do * p[hid : 2 * hid]
        di, df = dcn * cc, dcn * cp  # of the gates' outputs
        if prm["coupled"]:  # f = 1 - i
            di, df = di - df, xp.zeros_like(df)
        di = _through(di * i * (1 - i), in_i)
        df = _through(df * f * (1 - f), in_f)
        dcc = _through(dcn * i * (1 - cc * cc), in_c)
        dcp = dcn * f
        if p is not None:
            dcp = dcp + di * p[:hid] + df * p[2 * hid :]
            dp = dp + xp.concatenate([(di * cp).sum(0), (do * cn).sum(0), (df * cp).sum(0)])
        dg[t] = xp.concatenate([di, do, df, dcc], axis=1)
        dh = dg[t] @ r + xp.where(valid[t], 0, dh)
        dc = dcp + xp.where(valid[t], 0, dc)
    hps = xp.stack([c[0] for c in cache])
    flat, db = _flat2, dg.sum(axis=(0, 1))
    return {
        "x": xp.matmul(dg, prm["w"]),
        "w": flat(dg).T @ flat(x),
        "r": flat(dg).T @ flat(hps),
        "b": xp.concatenate([db, db]),
        "p": dp,
        "h0": dh,
        "c0": dc,
    }


# -- the ops --------------------------------------------------------------------------------------
def _forward(xp, kind: str, ins: dict, attrs: dict, keep: bool = False) -> tuple[dict, list]:
    """The op's outputs (Y, Y_h[, Y_c]) and, with `keep`, each direction's (idx, valid, x, prm,
    cache) for the gradient."""
    ins = _seq_major(xp, ins, attrs)
    ys, hs, cs, saved = [], [], [], []
    for _, idx, valid, cols, prm in _directions(xp, kind, ins, attrs):
        x = _gather(ins["X"], idx, cols)
        if kind == "gru":
            y, h, cache = gru_steps(xp, x, prm, valid, bool(attrs.get("linear_before_reset")), keep)
        else:
            y, h, c, cache = lstm_steps(xp, x, prm, valid, keep)
            cs.append(c)
        ys.append(_gather(y, idx, cols))
        hs.append(h)
        saved.append((idx, valid, cols, x, prm, cache))
    y, states = _to_layout(xp, attrs, xp.stack(ys, axis=1), [xp.stack(hs)] + ([xp.stack(cs)] if cs else []))
    outs = {"Y": y, "Y_h": states[0]}
    if cs:
        outs["Y_c"] = states[1]
    return outs, saved


def _grads_in(xp, attrs: dict, douts: dict, like: dict) -> dict:
    """The output gradients in layout 0 (zeros for outputs that get none)."""
    out = {}
    for s in like:
        g = douts.get(s)
        if g is not None and attrs.get("layout", 0) == 1:
            g = xp.transpose(g, (1, 2, 0, 3)) if s == "Y" else xp.swapaxes(g, 0, 1)
        out[s] = g
    return out


def _vjp(kind: str):
    def vjp(xp, ins, outs, douts, attrs):
        fwd, saved = _forward(xp, kind, ins, attrs, keep=True)
        g = _grads_in(xp, attrs, douts, fwd)
        parts: dict[str, list] = {}
        for d, (idx, valid, cols, xd, prm, cache) in enumerate(saved):
            zero = xp.zeros_like(prm["h0"])
            dy = (
                xp.zeros(xd.shape[:2] + zero.shape[-1:], xd.dtype)
                if g["Y"] is None
                else _gather(g["Y"][:, d], idx, cols)
            )
            dh = zero if g["Y_h"] is None else g["Y_h"][d]
            if kind == "gru":
                r = gru_steps_grad(xp, xd, prm, valid, bool(attrs.get("linear_before_reset")), cache, dy, dh)
            else:
                dc = zero if g.get("Y_c") is None else g["Y_c"][d]
                r = lstm_steps_grad(xp, xd, prm, valid, cache, dy, dh, dc)
            r["x"] = _gather(r["x"], idx, cols)  # back to time order (idx is its own inverse)
            for k, v in r.items():
                parts.setdefault(k, []).append(v)
        res = {
            "X": sum(parts["x"]),
            "W": xp.stack(parts["w"]),
            "R": xp.stack(parts["r"]),
            "B": xp.stack(parts["b"]),
            "initial_h": xp.stack(parts["h0"]),
        }
        if kind == "lstm":
            res.update(initial_c=xp.stack(parts["c0"]), P=xp.stack(parts["p"]))
        if attrs.get("layout", 0) == 1:
            res["X"] = xp.swapaxes(res["X"], 0, 1)
            res["initial_h"] = xp.swapaxes(res["initial_h"], 0, 1)
            if "initial_c" in res:
                res["initial_c"] = xp.swapaxes(res["initial_c"], 0, 1)
        return {s: v.astype(ins[s].dtype, copy=False) for s, v in res.items() if s in ins}

    return vjp


def _kernel(kind: str):
    def kernel(xp, ins, attrs):
        return _forward(xp, kind, ins, attrs)[0]

    return kernel


def _shape(kind: str):
    def infer(s: dict, attrs: dict) -> dict:
        x, r = s["X"], s["R"]
        dirs, hid = DIRECTIONS.get(attrs.get("direction", "forward"), 1), r[-1]
        if attrs.get("layout", 0) == 1:
            y, st = (x[0], x[1], dirs, hid), (x[0], dirs, hid)
        else:
            y, st = (x[0], dirs, x[1], hid), (dirs, x[1], hid)
        return {"Y": y, "Y_h": st, "Y_c": st} if kind == "lstm" else {"Y": y, "Y_h": st}

    return infer


_GRU_DOC = """ONNX GRU: Y (every step's hidden state), Y_h (the last one) from X, W, R and the optional
B, sequence_lens, initial_h; directions forward / reverse / bidirectional, linear_before_reset,
layout 0 / 1 (see ops_registry.rnn)."""
_LSTM_DOC = """ONNX LSTM: Y, Y_h and Y_c (the last cell state) from X, W, R and the optional B,
sequence_lens, initial_h, initial_c, P (peepholes); directions forward / reverse / bidirectional,
layout 0 / 1 (see ops_registry.rnn)."""

register(
    OpDef(
        "gru",
        "dense",
        ("X", "W", "R", "B?", "sequence_lens?", "initial_h?"),
        ("Y?", "Y_h?"),
        _kernel("gru"),
        _vjp("gru"),
        no_grad=("sequence_lens",),
        infer_shape=_shape("gru"),
        onnx="GRU",
        attrs={**_ATTRS, "linear_before_reset": 0},
        doc=_GRU_DOC,
    )
)
register(
    OpDef(
        "lstm",
        "dense",
        ("X", "W", "R", "B?", "sequence_lens?", "initial_h?", "initial_c?", "P?"),
        ("Y?", "Y_h?", "Y_c?"),
        _kernel("lstm"),
        _vjp("lstm"),
        no_grad=("sequence_lens",),
        infer_shape=_shape("lstm"),
        onnx="LSTM",
        attrs={**_ATTRS, "input_forget": 0},
        doc=_LSTM_DOC,
    )
)
