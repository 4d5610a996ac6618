"""What builds a hetps Program: the builder API (`builder`), model files of any kind (`load`), ONNX
(`onnx/`) and PaddlePaddle (`paddle/`)."""
