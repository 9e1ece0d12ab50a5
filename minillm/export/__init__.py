"""Other runtimes' formats: ONNX and ONNX Runtime (chapter 03), TensorRT (chapter 04) and
GGUF for llama.cpp (chapter 08). Each module imports its runtime only when used."""
