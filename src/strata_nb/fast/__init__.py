"""The fast tier: the kernels and launches that make a decode step fast on a GPU, fenced
apart from the plain tier a learner reads (src/strata_nb/kernels/).

Every fast kernel opens by naming its plain twin (the kernel it must equal) and what it
buys; `twins.TWINS` maps each plain launcher to its fast one, and the fast backend
(backend.py) runs a twin wherever the engine asks for the plain launcher. Nothing in the
plain tier imports from here.
"""
