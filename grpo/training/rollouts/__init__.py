"""The one rollout path of a GRPO step, for a single completion and a multi-turn episode alike.

A single-turn problem is an episode of one turn (`grpo.core.episodes.completion_episode`);
its group's first turn is one sampling request of G completions, so batching and the
shared-prefix trainer keep their speed. Modules, in the order a step uses them:

- `problems`: the problems a run samples (`Problem`), built from dataset rows, and a step's.
- `clients`: what the path asks of a tokenizer and a sampler (`Tokenizer`, `Sampler`).
- `grading`: a job in flight (`Job`) and what it sampled, graded: completions scored by
  --reward (`StepRollouts`) or played episodes (`PlayedGroups`); dynamic sampling's refill;
  group advantages and the trainable groups in one record (`GradedStep`).
- `sampling`: G completions of a problem in one request (`RolloutJob`).
- `episodes`: one episode of an environment turn by turn (`play_episode`), G per task
  (`play_groups`, an `EpisodeJob`).
- `step`: the GRPO step's questions answered once for both kinds (`submit_ahead`: a step's
  sampling K steps ahead, each round's problems and seeds from
  `grpo.training.run.seeds.RoundSeeds`; `take` with its staleness; `grade`;
  `reference_logprobs`; `evaluate_test`); packing is `grpo.core.episodes.pack_rollout_groups`.
- `records`: rollouts.jsonl's records of a graded step's first groups (`step_records`).
- `evaluation`: n samples (episodes) of every test problem graded, for `grpo eval` and
  the in-training evaluation.
"""
