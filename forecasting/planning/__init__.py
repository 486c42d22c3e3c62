"""Planning: off-peak windows (``offpeak``), the prewarm plan (``planner``), and how right a plan
was after the fact (``accuracy``)."""
