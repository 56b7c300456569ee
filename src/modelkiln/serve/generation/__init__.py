"""Text generation in ``kiln serve``: a continuous-batching scheduler around the generation
engine (scheduler.py), the served model (model.py: a ``served.ServedModel``), request parameters
(params.py), and the protocol edges: OpenAI (openai_routes.py), Triton's generate extension
(generate_routes.py), OIP infer and gRPC streaming (oip.py, called by the model)."""
