"""The Make targets that benchmark trainscope itself, each writing committed results: what stage timing costs
(`overhead`, make bench-overhead), train.py against the HF Trainer (`trainer_peer`, make bench-trainer), and the
dropout loop's draw against torch's (`dropout_draw`, make bench-dropout-draw)."""

__all__ = ["overhead", "trainer_peer", "dropout_draw"]
