"""Privacy audits beside the accountant's ε (issue 36): a one-run audit's ε lower bound
(:mod:`.bound`, no torch), its guesses and logged metrics (:mod:`.guesses`), its white-box canaries in
DP-SGD's steps (:mod:`.white_box`), its black-box canaries among the training examples
(:mod:`.black_box`), and the bugs tests plant to check it (:mod:`.planted`)."""
