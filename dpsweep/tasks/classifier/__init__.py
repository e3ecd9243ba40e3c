"""``task=classifier``, image classification with DP-SGD (or without DP): the task and its run
(:mod:`dpsweep.tasks.classifier.task`), and its passes over batches (:mod:`dpsweep.tasks.classifier.passes`)."""
