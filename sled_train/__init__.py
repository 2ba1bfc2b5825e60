"""sled-train: drafters trained for a target (self-distillation), written as ONNX for the device."""
