"""`trainscope tune -- <your training command>`: the advisor's changes tried from outside the script, kept where
the run trains the same model faster (trainscope.tune.main); the command and its changes (trainscope.tune.command);
the rounds and the plan (trainscope.tune.tuner)."""

__all__ = ["command", "main", "tuner"]
