"""Factorized models of ratings under joint user-level DP (issue 35): ``task=recommender``
(:mod:`dpsweep.tasks.recommender.task`), written as the design's roles (clients, a trusted aggregator,
an untrusted server): DP alternating least squares (:mod:`dpsweep.tasks.recommender.als`, through public
features: :mod:`~dpsweep.tasks.recommender.features`) and user-level DP-SGD on the item side, DPAM's and
the joint baseline's (:mod:`dpsweep.tasks.recommender.sgd`)."""
