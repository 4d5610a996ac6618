"""Export the exporter matrix's Keras model to ONNX with tf2onnx: run by hand in a virtual environment
with tensorflow 2.21 and tf2onnx 1.17 (python -m venv venv-tf; venv-tf/bin/pip install tensorflow-cpu
tf2onnx); the files beside this script are committed, so the tests need neither.

    venv-tf/bin/python tests/models/exporters/export_keras.py

xDeepFM with its CIN written as Keras 1x1 Conv2D layers over [B, D, 1, H*F] (how Keras CTR
libraries write it), sizes as in export_torch.py; output: the click probability [batch, 1].
Keras 3 refuses raw tf.* calls on functional-API tensors, so the model is a keras.Model subclass
exported with tf2onnx.convert.from_function. Biases start non-zero: tf2onnx's optimizer folds away
an Add of an all-zero constant, which would leave a freshly initialised model without biases.
TensorFlow's own SGD steps on one batch (binary cross-entropy) are saved as
`xdeepfm_conv_tf2onnx_tf_steps.npz`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tensorflow as tf
import tf2onnx

HERE = Path(__file__).resolve().parent
VOCAB, DIM, SLOTS, DENSE = 40, 4, 3, 4
OPSET = 18


class XDeepFMKeras(tf.keras.Model):
    def __init__(self) -> None:
        super().__init__()
        bias = tf.keras.initializers.RandomNormal(stddev=0.1, seed=3)
        self.emb = tf.keras.layers.Embedding(VOCAB, DIM)
        self.convs = [tf.keras.layers.Conv2D(h, 1, bias_initializer=bias) for h in (4, 3)]
        self.deep = tf.keras.layers.Dense(8, activation="relu", bias_initializer=bias)
        self.out = tf.keras.layers.Dense(1, activation="sigmoid", bias_initializer=bias)

    def call(self, inputs):
        sparse, dense = inputs
        e = self.emb(sparse)  # [B, F, D]
        xk, outs = e, []
        for conv in self.convs:
            h = xk.shape[1]
            z = tf.einsum("bhd,bmd->bhmd", xk, e)  # [B, H, F, D]
            z = tf.transpose(tf.reshape(z, [-1, h * SLOTS, DIM]), [0, 2, 1])[:, :, None, :]  # [B, D, 1, H*F]
            xk = tf.transpose(tf.squeeze(conv(z), 2), [0, 2, 1])  # [B, h', D]
            outs.append(tf.reduce_sum(xk, -1))
        deep = self.deep(tf.concat([tf.reshape(e, [-1, SLOTS * DIM]), dense], 1))
        return self.out(tf.concat([*outs, deep], 1))


def main(steps: int = 8, batch: int = 16, lr: float = 0.2) -> None:
    tf.keras.utils.set_random_seed(14)
    model = XDeepFMKeras()
    model([np.zeros((2, SLOTS), np.int64), np.zeros((2, DENSE), np.float32)])
    spec = (
        tf.TensorSpec((None, SLOTS), tf.int64, name="sparse"),
        tf.TensorSpec((None, DENSE), tf.float32, name="dense"),
    )
    path = HERE / "xdeepfm_conv_tf2onnx.onnx"
    tf2onnx.convert.from_function(
        tf.function(lambda s, d: model([s, d])), input_signature=spec, opset=OPSET, output_path=str(path)
    )
    print("wrote", path.name)
    rng = np.random.default_rng(21)
    sparse, dense = rng.integers(0, VOCAB, (batch, SLOTS)), rng.normal(size=(batch, DENSE)).astype(np.float32)
    label = rng.integers(0, 2, (batch, 1)).astype(np.float32)
    opt, bce, losses = tf.keras.optimizers.SGD(lr), tf.keras.losses.BinaryCrossentropy(), []
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = bce(label, model([sparse, dense]))
        losses.append(float(loss))
        opt.apply_gradients(
            zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables, strict=True)
        )
    out = HERE / "xdeepfm_conv_tf2onnx_tf_steps.npz"
    np.savez(out, sparse=sparse, dense=dense, label=label, loss=np.array(losses))
    print("wrote", out.name)


if __name__ == "__main__":
    main()
