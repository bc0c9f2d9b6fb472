;;;; contract.lisp -- the core's contract (src/core/package.lisp): the front
;;;; ends name only what GALLOP.CORE exports, and every export is named by a
;;;; front end, or stands on the allow-list below with its reason.
;;;;
;;;; The front ends are src/package.lisp, src/native/, src/clack/ and
;;;; src/hunchentoot/.  Each of their files is read with the Lisp reader,
;;;; *PACKAGE* following its IN-PACKAGE forms, and every symbol whose home
;;;; is GALLOP.CORE is collected, with the names a DEFPACKAGE imports from
;;;; it.  The text is searched too, comments and strings included, so that
;;;; no front end writes GALLOP.CORE:: and none names, even in a docstring,
;;;; a core symbol as if it were exported.  No server, no socket.

(in-package #:gallop-tests)

(in-suite core)

(defparameter *front-end-files*
  '("src/package.lisp" "src/native/*.lisp" "src/clack/*.lisp" "src/hunchentoot/*.lisp")
  "The front ends' source files, as patterns relative to system gallop's
directory.")

(defparameter *exports-for-users*
  '(;; doc/limits.md gives it as the most a log line holds: a number a user
    ;; may read, though no front end needs it.
    "+MAX-LOG-LINE+")
  "The names GALLOP.CORE exports though no front end names them, each with
the reason it stays.  Every other export no front end names is dead.")

(defun core-package ()
  (find-package "GALLOP.CORE"))

(defun core-external-p (name)
  "True when GALLOP.CORE exports a symbol named NAME."
  (eq :external (nth-value 1 (find-symbol name (core-package)))))

(defun front-end-files ()
  "Every front-end source file (*FRONT-END-FILES*), as (path . name), NAME
relative to the system's directory."
  (let ((root (asdf:system-source-directory "gallop")))
    (loop for pattern in *front-end-files*
          append (loop for path in (directory (merge-pathnames pattern root))
                       collect (cons path (enough-namestring path root))))))

(defun map-form-symbols (function form)
  "Call FUNCTION on every symbol in FORM, as read: in conses, in vectors, and
under backquote's commas (SBCL reads ,X and ,@X as objects, not lists)."
  (labels ((walk (x)
             (typecase x
               (symbol (funcall function x))
               (cons (loop for tail = x then (cdr tail)
                           while (consp tail)
                           do (walk (car tail))
                           finally (walk tail)))
               (sb-impl::comma (walk (sb-impl::comma-expr x)))
               (string nil)
               (vector (map nil #'walk x)))))
    (walk form)))

(defun form-named-p (form name)
  "True when FORM is a list whose operator is named NAME, in any package."
  (and (consp form) (symbolp (first form)) (string= name (symbol-name (first form)))))

(defun defpackage-core-imports (form)
  "The names the DEFPACKAGE FORM imports from GALLOP.CORE, as strings."
  (loop for option in (cddr form)
        when (and (consp option)
                  (member (first option) '(:import-from :shadowing-import-from))
                  (string= "GALLOP.CORE" (string (second option))))
          append (mapcar #'string (cddr option))))

(defun front-end-core-symbols (path)
  "The symbols of GALLOP.CORE the file at PATH names, as its forms are read
with *PACKAGE* following its IN-PACKAGE forms; a name its DEFPACKAGE forms
import from GALLOP.CORE counts as named.  A package not loaded in this image (Clack's,
for src/clack/) reads as a scratch package of the test's, deleted after: the
core's symbols are only reached there through an explicit prefix."
  (let* ((core (core-package))
         (scratch (make-package (symbol-name (gensym "CONTRACT-READ-")) :use '("COMMON-LISP")))
         (*package* (find-package "CL-USER"))
         (*read-eval* t)
         (found '()))
    (flet ((note (symbol)
             (when (eq (symbol-package symbol) core)
               (pushnew symbol found))))
      (unwind-protect
           ;; A prefix naming a package not loaded, or a symbol not external
           ;; (GALLOP.CORE:INTERNAL), is read anyway: the reader's CONTINUE.
           (handler-bind ((sb-int:simple-reader-package-error
                            (lambda (condition)
                              (let ((restart (find-restart 'continue condition)))
                                (when restart (invoke-restart restart))))))
             (with-open-file (in path :external-format :utf-8)
               (loop for form = (read in nil in)
                     until (eq form in)
                     do (map-form-symbols #'note form)
                        (when (form-named-p form "DEFPACKAGE")
                          (dolist (name (defpackage-core-imports form))
                            (let ((symbol (find-symbol name core)))
                              (when symbol (note symbol)))))
                        (when (form-named-p form "IN-PACKAGE")
                          (setf *package* (or (find-package (second form)) scratch))))))
        (delete-package scratch)))
    found))

(defun text-word (text start)
  "The word of TEXT from START to the first space, parenthesis, quote, comma
or semicolon, without a period, comma or colon at its end; a word broken at
a hyphen across lines (in a comment or docstring) is joined.  Returns the
word and where it ends."
  (flet ((word-end (from)
           (or (position-if (lambda (c)
                              (member c '(#\Space #\Tab #\Newline #\( #\) #\' #\` #\, #\" #\;)))
                            text :start from)
               (length text))))
    (let* ((end (word-end start))
           (word (subseq text start end)))
      (when (and (plusp (length word))
                 (char= #\- (char word (1- (length word))))
                 (< end (length text))
                 (char= #\Newline (char text end)))
        (let ((next (position-if-not (lambda (c) (member c '(#\Space #\Tab #\Newline #\;)))
                                     text :start end)))
          (when next
            (let ((rest (word-end next)))
              (setf word (concatenate 'string word (subseq text next rest))
                    end rest)))))
      (values (string-right-trim ".,:" word) end))))

(defun front-end-core-mentions (path)
  "Every GALLOP.CORE:NAME and GALLOP.CORE::NAME written in the file at PATH,
in code, comments and strings alike, as (NAME . DOUBLE-COLON-P), NAME in
upper case."
  (let* ((text (uiop:read-file-string path :external-format :utf-8))
         (prefix "gallop.core:")
         (found '()))
    (loop for start = (search prefix text :test #'char-equal)
            then (search prefix text :test #'char-equal :start2 end)
          for end = (and start (+ start (length prefix)))
          while start
          do (let ((double (and (< end (length text)) (char= #\: (char text end)))))
               (push (cons (string-upcase (text-word text (if double (1+ end) end))) double)
                     found)))
    (nreverse found)))

(defun contract-breaches ()
  "What the front ends name of GALLOP.CORE beyond its exports, one line each."
  (let ((breaches '()))
    (loop for (path . file) in (front-end-files)
          do (dolist (symbol (front-end-core-symbols path))
               (unless (core-external-p (symbol-name symbol))
                 (push (format nil "~A names GALLOP.CORE::~A, which the core does not export"
                               file (symbol-name symbol))
                       breaches)))
             (loop for (name . double) in (front-end-core-mentions path)
                   do (cond (double
                             (push (format nil "~A writes GALLOP.CORE::~A (two colons)" file name)
                                   breaches))
                            ((not (core-external-p name))
                             (push (format nil "~A writes GALLOP.CORE:~A, which the core does not export"
                                           file name)
                                   breaches)))))
    ;; The packages as loaded: a symbol imported into a front end's package
    ;; by any means.
    (dolist (name '("GALLOP" "CLACK.HANDLER.GALLOP"))
      (let ((package (find-package name)))
        (when package
          (do-symbols (symbol package)
            (when (and (eq (symbol-package symbol) (core-package))
                       (not (core-external-p (symbol-name symbol))))
              (pushnew (format nil "package ~A holds GALLOP.CORE::~A" name (symbol-name symbol))
                       breaches :test #'string=))))))
    (sort breaches #'string<)))

(defun dead-exports ()
  "The names GALLOP.CORE exports that no front end names, bar
*EXPORTS-FOR-USERS*; and the names of that list the core does not export."
  (let ((named (make-hash-table)) (dead '()))
    (loop for (path) in (front-end-files)
          do (dolist (symbol (front-end-core-symbols path))
               (setf (gethash symbol named) t)))
    (do-external-symbols (symbol (core-package))
      (unless (or (gethash symbol named)
                  (member (symbol-name symbol) *exports-for-users* :test #'string=))
        (push (symbol-name symbol) dead)))
    (values (sort dead #'string<)
            (remove-if #'core-external-p *exports-for-users*))))

(test front-ends-name-only-the-cores-exports
  "No front-end file names a GALLOP.CORE symbol the core does not export,
in code, in a DEFPACKAGE's imports or in its text, and none writes
GALLOP.CORE::."
  (let ((breaches (contract-breaches)))
    (is (null breaches)
        "The front ends reach inside the core (export it in src/core/package.lisp, ~
or use an export):~{~%  ~A~}" breaches)))

(test every-core-export-is-named-by-a-front-end
  "Every export of GALLOP.CORE is named by a front end, or listed with its
reason in *EXPORTS-FOR-USERS*."
  (multiple-value-bind (dead stale) (dead-exports)
    (is (null dead)
        "GALLOP.CORE exports what no front end names (un-export it, or list it ~
with its reason in *EXPORTS-FOR-USERS*):~{~%  ~A~}" dead)
    (is (null stale) "*EXPORTS-FOR-USERS* lists names the core does not export:~{~%  ~A~}"
        stale)))
