"""Factorized models of ratings under joint user-level DP (issue 35): ``task=recommender``
(:mod:`dpsweep.tasks.recommender.task`), trained by DP alternating least squares written as the design's
roles: clients, a trusted aggregator, an untrusted server (:mod:`dpsweep.tasks.recommender.als`)."""
