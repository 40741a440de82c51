"""python -m trainscope.predict --calibrate: make predict-calibrate."""

from trainscope.predict import main

main()
