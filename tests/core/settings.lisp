;;;; settings.lisp -- the table of settings (src/core/settings.lisp) and the
;;;; front ends built from it: every setting is a keyword of MAKE-ENGINE and
;;;; GALLOP:START with the table's default, and an initarg of
;;;; GALLOP:TASKMASTER.  Pure: no server, no socket.
;;;;
;;;; Internals of GALLOP.CORE reached on purpose: +SETTINGS+
;;;; (settings.lisp): the table the front ends' keywords and initargs are
;;;; checked against.

(in-package #:gallop-tests)

(in-suite core)

(defun key-parameters (function)
  "FUNCTION's &KEY parameters, as an alist of (KEYWORD . DEFAULT-FORM)."
  (loop for parameter in (rest (member '&key (sb-introspect:function-lambda-list function)))
        until (member parameter lambda-list-keywords)
        collect (destructuring-bind (name &optional default) (if (consp parameter)
                                                                parameter
                                                                (list parameter))
                  (cons (intern (symbol-name (if (consp name) (second name) name)) :keyword)
                        default))))

(defun class-initargs (class-name)
  "Every initarg of the slots of the class CLASS-NAME."
  (let ((class (find-class class-name)))
    (sb-mop:finalize-inheritance class)
    (mapcan (lambda (slot) (copy-list (sb-mop:slot-definition-initargs slot)))
            (sb-mop:class-slots class))))

(test the-settings-table-is-well-formed
  "Each setting once, documented, with a default that is NIL (off, or worked
out when the server starts) or a positive number; the standby count within
the maximum."
  (let ((names (mapcar (lambda (entry) (symbol-name (first entry))) gallop.core::+settings+)))
    (is (= (length names) (length (remove-duplicates names :test #'string=))) "~S" names)
    (dolist (entry gallop.core::+settings+)
      (destructuring-bind (name default documentation) entry
        (is (and (stringp documentation) (< 20 (length documentation))) "~S's documentation" name)
        (let ((value (eval default)))
          (is (or (null value) (and (realp value) (plusp value))) "~S's default: ~S" name value))))
    (is (<= (eval (gallop.core:setting-default standby-thread-count))
            (eval (gallop.core:setting-default max-thread-count))))))

(test every-front-end-takes-every-setting
  "MAKE-ENGINE and GALLOP:START (and so Clack's handler, which passes its
options to START) take each setting as a keyword with the table's default;
GALLOP:TASKMASTER takes each as an initarg."
  (let ((engine (key-parameters #'gallop.core:make-engine))
        (start (key-parameters #'gallop:start))
        (taskmaster (class-initargs 'gallop:taskmaster)))
    (dolist (entry gallop.core::+settings+)
      (destructuring-bind (name default &rest documentation) entry
        (declare (ignore documentation))
        (let ((key (intern (symbol-name name) :keyword)))
          (is (equal (list key default) (let ((p (assoc key engine))) (and p (list key (cdr p)))))
              "MAKE-ENGINE's ~S: ~S" key (assoc key engine))
          (is (equal (list key default) (let ((p (assoc key start))) (and p (list key (cdr p)))))
              "GALLOP:START's ~S: ~S" key (assoc key start))
          (is (member key taskmaster) "GALLOP:TASKMASTER has no initarg ~S" key))))))

(test the-readme-documents-every-setting
  "README.md's settings table has a row for each setting, and none for a
setting that does not exist."
  (let* ((readme (uiop:read-file-lines
                  (merge-pathnames "README.md" (asdf:system-source-directory "gallop"))))
         (table (let ((start (position "## Settings" readme :test #'string=)))
                  (is-true start "README.md has no \"## Settings\" section")
                  (and start
                       (loop for line in (nthcdr (1+ start) readme)
                             until (uiop:string-prefix-p "## " line)
                             when (uiop:string-prefix-p "| `:" line)
                               collect (subseq line 4 (position #\` line :start 4))))))
         (settings (mapcar (lambda (entry) (string-downcase (symbol-name (first entry))))
                           gallop.core::+settings+)))
    (dolist (setting settings)
      (is (member setting table :test #'string=) "README.md's table lacks :~A" setting))
    (dolist (row table)
      (is (member row settings :test #'string=) "README.md's table names :~A, not a setting" row))))
