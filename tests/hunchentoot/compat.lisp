;;;; compat.lisp -- every internal name of Hunchentoot, usocket and cl+ssl
;;;; that Gallop uses is in the table of src/hunchentoot/compat.lisp
;;;; (*INTERNAL-NAMES*), used in that file only, and there in the library
;;;; loaded.  Read from the sources: no server.

(in-package #:gallop-tests)

(in-suite taskmaster)

(defparameter +internal-packages+ '("HUNCHENTOOT" "USOCKET" "CL+SSL"))

(defun internal-names-in (text)
  "The (PACKAGE NAME) pairs TEXT names as internal: PACKAGE::NAME, or
\(FIND-SYMBOL \"NAME\" '#:PACKAGE), upper-cased."
  (let ((found '()))
    (dolist (package +internal-packages+ found)
      (let ((prefix (format nil "~(~A~)::" package)))
        (loop for at = (search prefix text :test #'char-equal) then (search prefix text :start2 (1+ at) :test #'char-equal)
              while at
              do (let* ((start (+ at (length prefix)))
                        (end (or (position-if (lambda (ch) (find ch " ()'
")) text :start start)
                                 (length text))))
                   (pushnew (list package (string-upcase (subseq text start end))) found
                            :test #'equal))))
      (let ((suffix (format nil "\" '#:~(~A~))" package)))
        (loop for at = (search suffix text :test #'char-equal) then (search suffix text :start2 (1+ at) :test #'char-equal)
              while at
              do (let ((open (position #\" text :end at :from-end t)))
                   (pushnew (list package (string-upcase (subseq text (1+ open) at))) found
                            :test #'equal)))))))

(defun occurrences (needle text)
  (loop for at = (search needle text) then (search needle text :start2 (1+ at))
        while at count t))

(defun source-text (file)
  (uiop:read-file-string (merge-pathnames file (asdf:system-source-directory "gallop"))))

(test hunchentoot-internals-only-in-the-compat-table
  "No file of the Hunchentoot layer but compat.lisp names an internal of
Hunchentoot, usocket or cl+ssl; each that compat.lisp names is in its
table, each in the table is named there, and exists in the library loaded
\(+VALID-REQUEST-METHODS+ only from Hunchentoot 1.3)."
  (let ((table (mapcar (lambda (entry) (list (first entry) (second entry)))
                       gallop::*internal-names*)))
    (dolist (file (directory (merge-pathnames "src/**/*.lisp"
                                              (asdf:system-source-directory "gallop"))))
      (unless (string= "compat" (pathname-name file))
        (is (null (internal-names-in (uiop:read-file-string file)))
            "~A names ~S" (enough-namestring file (asdf:system-source-directory "gallop"))
            (internal-names-in (uiop:read-file-string file)))))
    (let* ((text (source-text "src/hunchentoot/compat.lisp"))
           (named (internal-names-in text)))
      (dolist (name named)
        (is (member name table :test #'equal) "compat.lisp names ~S, not in its table" name))
      (dolist (entry table)
        ;; Named outside the table: as PACKAGE::NAME, or as a string (given
        ;; to FIND-SYMBOL or to a checker) besides the table's own.
        (destructuring-bind (package name) entry
          (is (or (search (format nil "~A::~A" package name) text :test #'char-equal)
                  (< 1 (occurrences (format nil "\"~A\"" name) text)))
              "the table lists ~S, which compat.lisp never uses" entry))))
    (dolist (entry gallop::*internal-names*)
      (destructuring-bind (package name kind &rest rest) entry
        (declare (ignore rest))
        (let ((symbol (find-symbol name package)))
          (unless (and (string= name "+VALID-REQUEST-METHODS+") ; 1.3.x only
                       (not (and symbol (boundp symbol))))
            (is (and symbol
                     (ecase kind
                       ((:function :accessor :generic-function) (fboundp symbol))
                       (:special (eq :special (sb-int:info :variable :kind symbol)))
                       (:constant (boundp symbol))
                       (:class (find-class symbol nil))
                       ((:slot :catch-tag) t)))
                "~A::~A (~(~A~)) is not in the library loaded" package name kind)))))))
