"""The human status page: `render` builds the pages from the same view dicts as the JSON API;
`cards`, `parts` and `style` are its pieces. Plain HTML and CSS, no JavaScript.
"""
