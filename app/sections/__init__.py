"""Drawing helpers of the method pages (one module per page): how a page shows a stored result, a report or a
group of widgets, kept out of the page script so that the page reads as Streamlit's own apps do: read the
widgets, call one function, draw. Nothing here computes what an analysis should."""
