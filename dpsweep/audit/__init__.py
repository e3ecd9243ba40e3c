"""Privacy audits beside the accountant's ε (issue 36): a one-run audit's ε lower bound
(:mod:`.bound`, no torch), its guesses and logged metrics (:mod:`.guesses`), its white-box canaries in a
private run's steps (:mod:`.white_box`, DP-FTRL's in :mod:`.own_steps`), its black-box canaries among the
training examples (:mod:`.black_box`), and the audit as the runner attaches it to a run, through the
private-step protocol of ``dpsweep.mechanisms.private_step`` (:mod:`.attach`). The bugs tests plant to
check it live with the tests (``tests/planted.py``), not here."""
