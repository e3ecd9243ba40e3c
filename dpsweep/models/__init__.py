"""Models: the image classifiers Opacus can make private, their optimizers, and VGG16's feature cache."""
