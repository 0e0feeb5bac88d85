"""The inference engines: what runs a loaded model's forward pass, chosen once when it is loaded.

`model.bert` is the reference encoder; an engine runs it, or a faster form of it, behind one interface
(`base.Engine`): the padded reference forward, the packed forward without padding on this CPU's kernels,
or an OpenVINO compilation of the checkpoint. `RelevanceModel` holds one and never branches per call.
"""
