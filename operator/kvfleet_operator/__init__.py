"""kvfleet operator: reconciles InferenceDeployments (serving.kvfleet.dev/v1alpha1) into agent Deployments."""
