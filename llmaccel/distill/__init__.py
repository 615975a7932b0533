"""Teacher -> student distillation (`llmaccel distill`): a tool above the engine; serving never imports it.

student.py picks the teacher's layers the student keeps and copies them; corpus.py turns the named
corpora (and the teacher's own chat answers) into token windows; distill_config.py holds a run's settings,
distiller.py its models, training step and checkpoints, and train.py runs the loop to its budget;
evaluate.py holds teacher and student against each other on held-out text. Floor "tools that drive the
engine": imports the Python API (llm.py), speculative decoding's heads, the model and below.
"""
