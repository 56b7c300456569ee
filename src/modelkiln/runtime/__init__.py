"""Running artifacts: tokenizer (runtime.tokenizer), engines (runtime.onnx; runtime.torch_encoder,
the torch engine; runtime.torch_engine, the PyTorch reference), the registry that picks a variant's
engine (runtime.registry) and the pipeline that joins them to a task (runtime.pipeline).

Import the submodules directly: this package file stays empty so that a process needing only the
tokenizer (Triton's tokenize model) does not load onnxruntime."""
