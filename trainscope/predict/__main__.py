"""python -m trainscope.predict --calibrate: make predict-calibrate."""

from trainscope.predict.calibration import main

main()
