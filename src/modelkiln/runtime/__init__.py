"""Running artifacts: tokenizer (runtime.tokenizer), engines (runtime.onnx, runtime.torch_engine)
and the pipeline that joins them to a task (runtime.pipeline).

Import the submodules directly: this package file stays empty so that a process needing only the
tokenizer (Triton's tokenize model) does not load onnxruntime."""
