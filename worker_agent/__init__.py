"""The daemon side of caliban-drain: the supervisor daemon and its agent workers.

``proto`` (wire types) · ``session`` (the resumable conversation file) · ``store``
(on-disk layout) · ``registry`` (live state) · ``process`` (worker processes) ·
``supervisor`` (what each verb does) · ``server`` (the accept loop) · ``client``
(blocking client) · ``worker`` and ``providers`` (the reference agent worker).
"""
