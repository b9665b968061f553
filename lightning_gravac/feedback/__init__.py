"""What the comm hook carries from one step to the next on the optimizer's behalf: moved moments."""
