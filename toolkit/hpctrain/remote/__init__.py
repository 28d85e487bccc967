"""Working from a laptop: a site's `[remote]` login host, reached through the user's own OpenSSH (issue 30).

`site` reads the `[remote]` table, `ssh` builds every ssh/rsync command line (pure, golden-tested) and reads
their failures, `travel` decides which local files go to the cluster, `forward` runs a command there.
"""
