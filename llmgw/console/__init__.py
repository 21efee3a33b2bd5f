"""The web console: ``llmgw server``'s fleet at a glance, live, in a browser.

``app`` answers the console's listener: its page (``static/``, shipped inside the
package and the single file), sign-in (``sessions``), the data of the admin API's
views for the roles that may see them, the actions an admin may take, and the live
feed (``live``) that the control plane's change bell drives. ``traffic`` keeps the
last hour of the routers' own counters; what ``ctl bench`` sent is kept by ``llmgw.bench.kept``.
"""
