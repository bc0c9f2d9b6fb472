;;;; compat.lisp -- every internal name of Hunchentoot, usocket and cl+ssl
;;;; that Gallop uses is in the table of src/hunchentoot/compat.lisp
;;;; (*INTERNAL-NAMES*), used in that file only, and there in the library
;;;; loaded.  Read from the sources: no server.

(in-package #:gallop-tests)

(in-suite taskmaster)

(defparameter *internal-packages* '("HUNCHENTOOT" "USOCKET" "CL+SSL"))

(defun internal-status (name package)
  "True when NAME is an internal symbol of PACKAGE (a name in
+INTERNAL-PACKAGES+), which may not be loaded."
  (and (find-package package)
       (eq :internal (nth-value 1 (find-symbol name package)))))

(defun tree-has-p (symbol-name tree)
  "True when TREE holds a symbol named SYMBOL-NAME."
  (typecase tree
    (cons (or (tree-has-p symbol-name (car tree)) (tree-has-p symbol-name (cdr tree))))
    (symbol (string= symbol-name (symbol-name tree)))))

(defun internal-names-read (file)
  "The (PACKAGE NAME) pairs FILE's forms name as internal, read with the
Lisp reader so that any spelling counts (PACKAGE::NAME, a nickname, `|...|'):
each symbol whose home is one of +INTERNAL-PACKAGES+ and not external
there; and each string that is the name of one where a string stands for a
name: given to FIND-SYMBOL, CHECK-INTERNAL-FUNCTION or FIND (a slot by
name), or listed for a DOLIST that calls FIND-SYMBOL.  NIL and the forms
left unread when FILE's package is not loaded here."
  (let ((found '()) (*package* (find-package :cl-user)))
    (labels ((note-string (string)
               (when (stringp string)
                 (dolist (package *internal-packages*)
                   (when (internal-status string package)
                     (pushnew (list package string) found :test #'equal)))))
             (walk (form)
               (typecase form
                 (cons
                  (when (symbolp (car form))
                    (let ((head (symbol-name (car form))))
                      (cond ((member head '("FIND-SYMBOL" "CHECK-INTERNAL-FUNCTION" "FIND")
                                     :test #'string=)
                             (when (consp (cdr form)) (note-string (second form))))
                            ((and (string= head "DOLIST") (consp (cdr form)) (consp (second form))
                                  (tree-has-p "FIND-SYMBOL" (cddr form)))
                             (let ((list (second (second form))))
                               (when (and (consp list) (eq (first list) 'quote))
                                 (mapc #'note-string (second list))))))))
                  (loop for rest = form then (cdr rest)
                        while (consp rest) do (walk (car rest))))
                 (symbol
                  (let ((home (symbol-package form)))
                    (when home
                      (let ((package (find (package-name home) *internal-packages* :test #'string=)))
                        (when (and package (internal-status (symbol-name form) package))
                          (pushnew (list package (symbol-name form)) found :test #'equal)))))))))
      (with-open-file (in file)
        (loop for form = (read in nil in)
              until (eq form in)
              do (when (and (consp form) (eq (first form) 'in-package))
                   (let ((package (find-package (second form))))
                     (unless package (return))
                     (setf *package* package)))
                 (walk form))))
    found))

(defun internal-names-in (text)
  "The (PACKAGE NAME) pairs TEXT names as PACKAGE::NAME, or as (FIND-SYMBOL
\"NAME\" '#:PACKAGE), upper-cased: for sources the reader cannot read here."
  (let ((found '()))
    (dolist (package *internal-packages* found)
      (let ((prefix (format nil "~(~A~)::" package)))
        (loop for at = (search prefix text :test #'char-equal)
                then (search prefix text :start2 (1+ at) :test #'char-equal)
              while at
              do (let* ((start (+ at (length prefix)))
                        (end (or (position-if (lambda (ch) (member ch '(#\Space #\Tab #\Newline #\( #\) #\')))
                                              text :start start)
                                 (length text))))
                   (pushnew (list package (string-upcase (subseq text start end))) found
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
        (let ((named (union (internal-names-read file)
                            (internal-names-in (uiop:read-file-string file))
                            :test #'equal)))
          (is (null named) "~A names ~S"
              (enough-namestring file (asdf:system-source-directory "gallop")) named))))
    (let* ((text (source-text "src/hunchentoot/compat.lisp"))
           (named (internal-names-read (merge-pathnames "src/hunchentoot/compat.lisp"
                                                        (asdf:system-source-directory "gallop")))))
      (is (< 20 (length named)) "the reader found ~D internal names in compat.lisp" (length named))
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
