"""The run shape: what kind of run this is, worked out once in setup from the flags, the launch and the model folder
(`build.build_shape`), and read everywhere else (`run_shape.RunShape`), with the one rule for splitting a sequence's
tokens over a CP group."""
