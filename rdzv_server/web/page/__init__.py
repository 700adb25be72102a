"""The human status page: `render` builds the pages from the same views as the JSON API; `cards`, `parts`,
`history`, `svg` and `style` are its pieces. Plain HTML and CSS, no JavaScript."""
