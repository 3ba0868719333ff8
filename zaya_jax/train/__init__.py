"""Training: optimizer, loss, load balancing, the train step and loop, metrics."""
