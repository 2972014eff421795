"""Public-domain passages for workloads whose answers copy a given text
(speculative decoding's benchmark and tests): fixed, so that runs repeat."""

# Lewis Carroll, Alice's Adventures in Wonderland (1865), the first paragraph
ALICE = ("Alice was beginning to get very tired of sitting by her sister on the bank, and of "
         "having nothing to do: once or twice she had peeped into the book her sister was "
         "reading, but it had no pictures or conversations in it, 'and what is the use of a "
         "book,' thought Alice 'without pictures or conversations?' So she was considering in "
         "her own mind (as well as she could, for the hot day made her feel very sleepy and "
         "stupid), whether the pleasure of making a daisy-chain would be worth the trouble of "
         "getting up and picking the daisies, when suddenly a White Rabbit with pink eyes ran "
         "close by her.")
# Jane Austen, Pride and Prejudice (1813), the first two sentences
AUSTEN = ("It is a truth universally acknowledged, that a single man in possession of a good "
          "fortune, must be in want of a wife. However little known the feelings or views of "
          "such a man may be on his first entering a neighbourhood, this truth is so well fixed "
          "in the minds of the surrounding families, that he is considered the rightful "
          "property of some one or other of their daughters.")
