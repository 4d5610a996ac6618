"""ONNX import: read and upgrade a model (`model`), rewrite exporters' patterns (`batch`,
`control_flow`, `embedding_bag`, `loss`), fold static values (`static`), one graph to a Program
(`graph`), the public `from_onnx` (`importer`)."""
