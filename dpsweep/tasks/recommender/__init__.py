"""Factorized models of ratings under joint user-level DP (issue 35): DP alternating least squares,
written as the design's roles (clients, a trusted aggregator, an untrusted server), in
:mod:`dpsweep.tasks.recommender.als`. Not a registered task yet: its config, its mechanism entry and
its run (``task=recommender``) are still to come."""
