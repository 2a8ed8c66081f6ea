"""The train state: what the step and `Model` ask of a model's variables and its forward
pass (linen and NNX), Keras's weight order, the layer plan and the global batch."""
