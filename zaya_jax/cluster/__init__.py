"""Running beyond one process: start-up of JAX's distributed runtime, the local launcher, cluster templates."""
