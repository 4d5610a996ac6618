"""What leaves the transpiler: ONNX of any Program (`onnx`), the forward part of a program
(`forward`), the servable forward graph of a Plan (`servable`) and the placement picture (`draw`)."""
