"""Predict a run before it runs -- peak memory per process, the steady step time and the run's time, "fits" or
"does not fit" -- and, once it has run, how far off each predicted quantity was.

How it works: docs/predict.md#in-the-code-the-predictors-parts-trainscopepredictorinitpy.
"""
