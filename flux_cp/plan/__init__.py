"""The planner: a run's memory (the transformer's weights, gradients, optimizer state and activations; the encoding
phase's peaks), its disk, its speed (a step's seconds from measured figures), `--compile auto` and `--plan`'s report
and recommended command."""
