"""Pieces shared by architectures: norms, GLU MLPs, KDA, MLA, MoE, block attention residuals."""
