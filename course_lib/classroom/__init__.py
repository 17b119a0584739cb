"""Teaching a class with the course: the labs as nbgrader assignments (:mod:`.grading`); the class
server itself is ``hub/`` (see the README's "Teaching a class")."""
