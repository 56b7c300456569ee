"""``kiln convert`` for text generation: where the weights come from, the graphs written, and the gate."""
