"""kvfleet operator: reconciles InferenceDeployment resources (a stub until the operator issue lands)."""
