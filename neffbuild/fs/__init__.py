"""The confined filesystem: files land beneath a cache dir only, atomically, with room checked first."""
