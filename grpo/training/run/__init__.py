"""The run of every recipe: lifecycle, run files, log, state, learner."""
