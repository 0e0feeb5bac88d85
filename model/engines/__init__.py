"""The inference engines: what runs a loaded model's forward pass, chosen once when it is loaded.

`model.bert` is the reference encoder; an engine runs it, or a faster form of it, behind one interface
(`base.Engine`), picked by `base.EngineKind`: the padded reference forward and the packed forward without
padding (`eager`, on the module `packed` builds and `kernels` fits to this CPU: `onednn` linears, the `fused`
C kernels), or the checkpoint compiled by OpenVINO (`openvino`, with `int8`'s static plan). `RelevanceModel`
holds one and never branches per call.
"""
