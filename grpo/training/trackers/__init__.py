"""Experiment trackers (`--log-to`): SwanLab, Weights & Biases, TensorBoard and Trackio.

`base` is the seam (a tracker's protocol and the run it is told about), `fanout` runs the
chosen trackers beside training, and each `*_tracker` module wraps one tool, importing its
package only when a run asks for it (each is an optional extra of grpo).
"""
