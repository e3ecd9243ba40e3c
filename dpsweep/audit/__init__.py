"""Privacy audits beside the accountant's ε (issue 36): a one-run audit's ε lower bound
(:mod:`.bound`, no torch) and its white-box canaries in DP-SGD's steps (:mod:`.white_box`)."""
