"""The learner's write-up: ``report`` assembles the final evidence report from runs/ (`labkit report`
with no inputs), ``notes`` copies a step's notes template pre-filled with that step's evidence."""
